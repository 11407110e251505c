"""Serving over HTTP: the OpenAI-compatible API and the engine clients (thread and process)."""
