"""prismd: a crash-safe Trio daemon connecting AI agents to chat platforms."""
