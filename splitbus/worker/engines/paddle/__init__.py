"""The PaddlePaddle engine: Llama and Qwen2 from a Hugging Face folder, on gpu_ops."""
