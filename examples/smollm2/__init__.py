"""SmolLM2-135M-Instruct, a pretrained Llama, generating with pallas_kv (see README "Real model: SmolLM2")."""
