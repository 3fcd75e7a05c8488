"""What writing server-sent events costs the host per event, two ways (issue #48): a thread per client woken
for each chunk's event (serve.py until the StreamWriter), and one thread that takes every event that has come
and writes each client's in one send (the StreamWriter's way).

    python3 scripts/bench_streams.py [--clients 64,256] [--chunks 32] [--interval-ms 4]

A producer puts one event per client per chunk, --interval-ms apart (the worker handing out a chunk); the
events are a streamed completion's JSON, written to socket pairs that another process drains. The process's
CPU time per event is what the GIL-holding side pays: under load it competes with the model worker for the
one GIL. Standard library only.
"""
import argparse
import json
import multiprocessing
import queue
import selectors
import socket
import statistics
import threading
import time


def drain(ours, theirs):
    for s in theirs:
        s.close()
    selector = selectors.DefaultSelector()
    for s in ours:
        selector.register(s, selectors.EVENT_READ)
    left = len(ours)
    while left:
        for key, _ in selector.select():
            if not key.fileobj.recv(1 << 16):
                selector.unregister(key.fileobj)
                left -= 1


def payload(chunk):
    return {"id": "cmpl-0123456789abcdef01234567", "object": "text_completion", "created": 1700000000, "model": "model",
            "choices": [{"text": f" word{chunk} and{chunk} more{chunk} text", "index": 0, "logprobs": None,
                         "finish_reason": None}]}


def sse(p):
    return f"data: {json.dumps(p, ensure_ascii=False)}\n\n"


def take_all(q):
    """The next item and every other that has come meanwhile."""
    items = [q.get()]
    while True:
        try:
            items.append(q.get_nowait())
        except queue.Empty:
            return items


def thread_per_client(sockets, chunks, interval):
    queues = [queue.Queue() for _ in sockets]

    def client(q, s):
        while True:
            pieces = take_all(q)
            if None in pieces:
                return
            s.sendall("".join(map(sse, pieces)).encode())
    threads = [threading.Thread(target=client, args=(q, s)) for q, s in zip(queues, sockets)]
    for t in threads:
        t.start()
    for k in range(chunks):
        for q in queues:
            q.put(payload(k))
        time.sleep(interval)
    for q in queues:
        q.put(None)
    for t in threads:
        t.join()


def one_writer(sockets, chunks, interval):
    work = queue.Queue()

    def writer():
        while True:
            items = take_all(work)
            out = {}
            for item in items:
                if item is None:
                    return
                s, p = item
                out.setdefault(s, []).append(sse(p))
            for s, parts in out.items():
                s.sendall("".join(parts).encode())
    thread = threading.Thread(target=writer)
    thread.start()
    for k in range(chunks):
        for s in sockets:
            work.put((s, payload(k)))
        time.sleep(interval)
    work.put(None)
    thread.join()


def run(way, clients, chunks, interval):
    pairs = [socket.socketpair() for _ in range(clients)]
    reader = multiprocessing.Process(target=drain, args=([b for _, b in pairs], [a for a, _ in pairs]))
    reader.start()
    for _, b in pairs:
        b.close()
    sockets = [a for a, _ in pairs]
    cpu = time.process_time()
    way(sockets, chunks, interval)
    cpu = time.process_time() - cpu
    for s in sockets:
        s.close()
    reader.join()
    return 1e6 * cpu / (clients * chunks)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", default="64,256")
    p.add_argument("--chunks", type=int, default=32)
    p.add_argument("--interval-ms", type=float, default=4.0)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    print("| clients | a thread per client, us of CPU an event | one writer thread | (median of the runs; each run) |\n"
          "|---|---|---|---|")
    for clients in map(int, args.clients.split(",")):
        runs = {way: [] for way in (thread_per_client, one_writer)}
        for _ in range(args.repeats):  # alternating, so that the machine's drift falls on both
            for way in runs:
                runs[way].append(run(way, clients, args.chunks, args.interval_ms / 1000))
        a, b = (statistics.median(r) for r in runs.values())
        print(f"| {clients} | {a:.1f} | {b:.1f} | {', '.join(f'{x:.0f}' for x in runs[thread_per_client])}; "
              f"{', '.join(f'{x:.0f}' for x in runs[one_writer])} |", flush=True)


if __name__ == "__main__":
    main()
