"""Compiling sub-models into artefacts, and loading them back."""
