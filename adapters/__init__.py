"""Chat platform adapters: Telegram, Signal, web chat."""
