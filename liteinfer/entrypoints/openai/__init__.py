"""The OpenAI-compatible server: request bodies (`protocol`) and the ASGI app (`api_server`)."""
