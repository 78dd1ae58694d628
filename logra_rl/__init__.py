"""logra_rl: RL post-training of LLMs with verifiable rewards, built on LoGRA."""

__version__ = "0.1.0"
