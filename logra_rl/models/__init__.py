"""Model and tokenizer loading, and the tiny models the CPU quickstart builds."""
