"""How a poolserve process starts, signals readiness, dies with its parent, logs and exits, and how
restarts back off: Linux process helpers that the supervisor and every service process share.
Imports only the standard library.
"""
