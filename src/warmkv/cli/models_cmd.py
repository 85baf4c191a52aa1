"""`warmkv models`: the models this machine can serve, and which a running server has loaded."""

from __future__ import annotations

import json
from typing import Annotated

import httpx
import typer
from rich.table import Table

from ..errors import WarmkvError
from .model_catalog import catalog
from .options import console, err, fail


def models(
    models_dir: Annotated[str | None, typer.Option("--models-dir", help="also list the models in DIR")] = None,
    server: Annotated[
        str | None, typer.Option("--server", help="a running warmkv server (http://HOST:PORT): its models' status")
    ] = None,
    api_key: Annotated[
        str | None, typer.Option("--api-key", envvar="WARMKV_API_KEY", help="the server's key, if it has one")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    """List the models `warmkv serve` can load: bundled, in a models directory, in the Hugging Face cache."""
    try:
        found = catalog(models_dir)
    except WarmkvError as e:
        fail(e)
    status: dict[str, str] = {}
    if server is not None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        try:
            r = httpx.get(server.rstrip("/") + "/v1/models", headers=headers, timeout=10)
            r.raise_for_status()
            data = r.json()["data"]
        except (httpx.HTTPError, ValueError, KeyError) as e:
            err.print(f"[bold red]error:[/] {server}: {e}")
            raise typer.Exit(2) from None
        for card in data:
            st = card.get("status") or {}
            if "path" in st:
                status[st["path"]] = st.get("value", "?")
    rows = [
        {"id": f.id, "source": f.source, "architecture": f.architecture, "size_mib": round(f.size_bytes / 2**20, 1),
         "status": status.get(str(f.path), "not served" if server else "-"), "path": str(f.path)}
        for f in found
    ]  # fmt: skip
    if as_json:
        console.print_json(json.dumps(rows))
        return
    t = Table(title="models")
    for col in ("id", "source", "architecture", "size MiB", "status", "path"):
        t.add_column(col)
    for r in rows:
        t.add_row(r["id"], r["source"], r["architecture"], f"{r['size_mib']:,}", r["status"], r["path"])
    console.print(t)
