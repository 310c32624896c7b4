"""``p2p-diloco dashboard``: a live web page of one run, read from the DHT alone (no central store).

A background thread reads the run's progress records every ``interval_s`` through a client-mode DHT node
(:class:`p2p_diloco.ops.status.SwarmView`) and keeps the history of what it saw since it started (a bounded window): the
swarm's eval loss, group sizes and live peers over time. A FastAPI app serves the page (``assets/dashboard``),
plotly.js from the plotly package (nothing is fetched from a CDN: the page works offline) and the data as JSON at
``/api/swarm``; uvicorn runs it until SIGINT or SIGTERM.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from importlib import resources
from pathlib import Path
from typing import Any

from p2p_diloco.config import NetworkSection
from p2p_diloco.errors import UserError, first_line
from p2p_diloco.network.records import PeerProgress
from p2p_diloco.ops.status import SwarmView, swarm_snapshot

HISTORY_POINTS = 4096  # reads kept for the plots (5.7 hours at the default interval)
PAGE = resources.files("p2p_diloco") / "assets" / "dashboard" / "index.html"

logger = logging.getLogger(__name__)


class SwarmHistory:
    """What the dashboard has read: the latest snapshot and, per read, each live peer's eval loss and group size and
    the swarm's totals and consensus (models held, consensus distance). Thread-safe: one reader thread adds, the web
    server's handlers read."""

    def __init__(self, run_id: str, max_points: int = HISTORY_POINTS):
        self.run_id = run_id
        self._lock = threading.Lock()
        self._points: collections.deque[dict[str, Any]] = collections.deque(maxlen=max_points)
        self._latest: dict[str, Any] = swarm_snapshot(run_id, [], time.time())

    def add(self, rows: list[PeerProgress], now: float) -> None:
        """Record one read of the progress records at DHT time ``now``."""
        snapshot = swarm_snapshot(self.run_id, rows, now)
        live = [peer for peer in snapshot["peers"] if peer["state"] == "live"]
        point = {
            "time": now,
            "eval_loss": {peer["peer_id"]: peer["eval_loss"] for peer in live if peer["eval_loss"] is not None},
            "group_size": {peer["peer_id"]: peer["group_size"] for peer in live},
            "swarm_eval_loss": snapshot["swarm"]["eval_loss"],
            "live_peers": snapshot["swarm"]["live_peers"],
            "lineages": snapshot["swarm"]["lineages"],
            "consensus_distance": snapshot["swarm"]["consensus_distance"],
        }
        with self._lock:
            self._latest = snapshot
            self._points.append(point)

    def view(self) -> dict[str, Any]:
        """The latest snapshot with the history as plot series: times, and per peer one value per read (null where
        the peer was not live or had no eval yet)."""
        with self._lock:
            points, latest = list(self._points), self._latest
        peers = sorted({peer for point in points for peer in point["group_size"]})
        series = {
            "time": [point["time"] for point in points],
            "swarm_eval_loss": [point["swarm_eval_loss"] for point in points],
            "live_peers": [point["live_peers"] for point in points],
            "lineages": [point["lineages"] for point in points],
            "consensus_distance": [point["consensus_distance"] for point in points],
            "eval_loss": {peer: [point["eval_loss"].get(peer) for point in points] for peer in peers},
            "group_size": {peer: [point["group_size"].get(peer) for point in points] for peer in peers},
        }
        return {**latest, "history": series, "reads": len(points)}


def read_forever(view: SwarmView, history: SwarmHistory, interval_s: float, stop: threading.Event) -> None:
    """Read ``view`` into ``history`` every ``interval_s`` until ``stop``; a failed read is logged and retried."""
    from p2p_diloco.network.dht import shared_time

    while not stop.is_set():
        try:
            history.add(view.read(), shared_time())
        except Exception as error:  # a DHT hiccup must not end the page
            logger.warning("reading the swarm failed: %s", first_line(error))
        stop.wait(interval_s)


def create_app(history: SwarmHistory) -> Any:
    """The FastAPI app: ``/`` the page, ``/plotly.min.js``, ``/api/swarm`` the data (:meth:`SwarmHistory.view`)."""
    import plotly
    from fastapi import FastAPI
    from fastapi.responses import FileResponse, HTMLResponse

    app = FastAPI(title=f"p2p_diloco swarm {history.run_id}", docs_url=None, redoc_url=None)
    plotly_js = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    page = PAGE.read_text(encoding="utf-8")

    @app.get("/", response_class=HTMLResponse)
    def index() -> str:
        return page

    @app.get("/plotly.min.js")
    def plotly_script() -> FileResponse:
        return FileResponse(plotly_js, media_type="application/javascript")

    @app.get("/api/swarm")
    def swarm() -> dict[str, Any]:
        return history.view()

    return app


def run_dashboard(network: NetworkSection, host: str, port: int, interval_s: float) -> int:
    """Serve the dashboard of ``network.run_id`` on ``host``:``port`` (0: a free port; the address is logged once it
    listens) until SIGINT or SIGTERM; returns 0. Raises UserError when the web packages are missing or the port cannot
    be bound, and as :class:`SwarmView`."""
    try:
        import uvicorn
    except ImportError:
        raise UserError("the dashboard needs its web packages: pip install 'p2p_diloco[dashboard]'") from None

    class Server(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.started:
                bound = self.servers[0].sockets[0].getsockname()[1]
                logger.info("dashboard of run %s at http://%s:%d", network.run_id, host, bound)

    history = SwarmHistory(network.run_id)
    view = SwarmView(network)
    stop = threading.Event()
    reader = threading.Thread(target=read_forever, args=(view, history, interval_s, stop), daemon=True)
    reader.start()
    server = Server(uvicorn.Config(create_app(history), host=host, port=port, log_level="warning"))
    try:
        server.run()  # handles SIGINT and SIGTERM itself
    finally:
        stop.set()
        reader.join(timeout=interval_s + 30)
        view.close()
    if not server.started:
        raise UserError(f"the dashboard could not listen on {host}:{port} (in use, or not allowed)")
    return 0
