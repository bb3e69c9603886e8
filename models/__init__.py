"""Model files and architectures: GGUF/safetensors loading, dequantization, tokenizer, the
decoder, tiny synthetic models. Imports nothing from the rest of Ember."""
