"""Model, paged memory, scheduler, sampler and the engines that drive them. Knows no tenants."""
