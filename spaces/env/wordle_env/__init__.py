"""Wordle as an OpenEnv environment: rules and words, wire models, the server-side environment, the client."""
