"""Integrations with the libraries users run: transformers (hf)."""
