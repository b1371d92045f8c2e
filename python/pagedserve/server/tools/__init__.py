"""Tool calling: what tools and tool_choice ask of the engine, the parsers that read a model's calls,
and the shipped tools template."""
