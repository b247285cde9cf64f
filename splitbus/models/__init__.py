"""Model files that need converting before the engine and tokenizer load them (GGUF checkpoints)."""
