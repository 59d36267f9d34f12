"""Parsers that split a model's output text into content, reasoning and tool calls,
incrementally per request."""
