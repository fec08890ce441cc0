"""``kvfleet router``: an OpenAI-compatible proxy that picks an engine replica per request
(filters, then scorers, a weighted sum and a max-score picker, after llm-d's endpoint picker)."""
