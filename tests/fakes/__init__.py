"""Fake servers for tests (Telegram Bot API, …)."""
