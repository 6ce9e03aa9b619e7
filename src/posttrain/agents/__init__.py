"""Agent training: tool schemas, tool-call parsing per chat-template family, environments, and
the multi-turn rollout loop."""
