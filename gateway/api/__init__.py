"""HTTP only: parse a request, call a service, render JSON or server-sent events."""
