"""A Python `ssl` client's first flight: python_client.py PORT NAME."""
import socket
import ssl
import sys

ctx = ssl.create_default_context()
ctx.check_hostname = False
ctx.verify_mode = ssl.CERT_NONE
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
try:
    ctx.wrap_socket(s, server_hostname=sys.argv[2])
except (ssl.SSLError, OSError):
    pass
