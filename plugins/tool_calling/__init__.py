"""Tool-call parsers for chat completions' ``tool_choice: "auto"``: the formats model families
write their calls in."""
