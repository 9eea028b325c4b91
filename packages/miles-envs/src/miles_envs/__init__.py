"""Miles' agentic package. Today: sandboxes (:mod:`miles_envs.sandbox`); see README.md for what is coming."""
