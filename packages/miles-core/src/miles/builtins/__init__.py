"""Built-in components. Each is registered through an entry point in miles-core's
pyproject.toml, exactly like a third-party plugin's."""
