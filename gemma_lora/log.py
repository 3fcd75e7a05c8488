"""The server's log: one line on stdout, written whole, whichever thread writes it."""
import sys
import threading
import time


LOG_LOCK = threading.Lock()


def log(message):
    """One line on stdout, written whole: print() writes the text and the newline apart, so two threads' lines
    could join ("...finish=length08:23:23 POST ..."), which a log shipper drops or misreads."""
    line = f"{time.strftime('%H:%M:%S')} {message}\n"
    with LOG_LOCK:
        sys.stdout.write(line)
        sys.stdout.flush()
