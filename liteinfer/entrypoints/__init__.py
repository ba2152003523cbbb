"""Ways to serve the engine: an OpenAI-compatible HTTP server (`openai/`)."""
