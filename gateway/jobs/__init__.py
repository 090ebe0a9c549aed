"""Background work: the lifecycle processor and the rolling-summary scheduler.

Both go through use cases (`gateway.services`); neither runs on a request's path.
"""
