"""Anthropic's Messages API over the same engine (`/v1/messages`, `/v1/messages/count_tokens`)."""
