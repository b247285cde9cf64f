"""Model files from outside the Hugging Face layout (GGUF today), turned into a folder that the
tokenizer, the engines and the API load unchanged. Imports no paddle: the API uses it too."""
