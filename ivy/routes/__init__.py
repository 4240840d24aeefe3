"""Ivy's routes, one module per group; `ivy.app` includes each module's `routes(ctx)`."""
