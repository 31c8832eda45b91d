"""How a poolserve process lives and dies, shared by the supervisor and every
service process: exit statuses as a protocol (``exitcodes``), die-with-parent
and the readiness pipe with its heartbeats (``child``, ``linux``), restart
back-off arithmetic (``backoff``), process names and wait statuses
(``procutil``), descriptor limits (``limits``), the log line format (``logs``).

May import: the standard library only.
"""
