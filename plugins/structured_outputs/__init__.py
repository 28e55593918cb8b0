"""Structured outputs with llguidance: JSON schemas, regular expressions, choices and Lark
grammars as token masks for the serving engine."""
