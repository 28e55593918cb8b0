"""Reasoning parsers for chat replies' ``reasoning_content``: how model families mark the
thinking they write before their answer."""
