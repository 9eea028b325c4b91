"""A deliberately broken Miles plugin (test fixture): its modules need a dependency that is not installed."""
