"""The serving platform: OpenAI routes, admin routes, tenancy, SQL registry, limits."""
