"""draft_speculation plugin."""
