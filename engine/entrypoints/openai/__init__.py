"""An OpenAI-compatible HTTP server: `python -m engine serve`."""
