"""Pure co-location policy: job shapes, shadow prices, interference model, guard, planner.

Imports nothing of the rest of the project.
"""
