"""GGUF checkpoints, converted once into a cached Hugging Face folder."""
