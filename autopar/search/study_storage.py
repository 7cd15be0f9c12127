"""The database an Optuna study lives in, named by a URL: SQLite's file (sqlite:///study.db, one
machine) or a database server (postgresql://user:password@host:5432/db; MySQL as
mysql+pymysql://...) that search processes on several machines share. Every study autopar writes
opens its storage here, so each gets the same heartbeats, the same failed-trial retries and the
same one-line errors. Optuna and SQLAlchemy are heavy: imported on first use.
"""

from __future__ import annotations

import re

from autopar.errors import AutoparError

HEARTBEAT_S = 1  # a running trial's heartbeat on the study storage
GRACE_S = 5  # a trial without a heartbeat this long was killed: failed, then retried
RETRIES = 3  # a trial failed by its heartbeat is retried this often with its parameters

POSTGRES_DRIVER = "psycopg"  # postgresql:// means psycopg 3 (autopar[postgres]), whatever SQLAlchemy's default
# the modules SQLAlchemy loads for a URL's driver -> what installs them
DRIVERS = {
    "psycopg": "pip install 'autopar[postgres]'",
    "psycopg2": "pip install psycopg2-binary, or write postgresql://... for psycopg (pip install 'autopar[postgres]')",
    "pymysql": "pip install pymysql",
    "MySQLdb": "write mysql+pymysql://... and pip install pymysql (mysql:// alone needs mysqlclient)",
}


def open_storage(url: str):
    """Optuna's RDB storage for `url`, with heartbeats: a trial whose process was killed is failed
    once its beat is GRACE_S old (any process's next trial on the study checks, against the
    database's clock) and retried with the same parameters."""
    import optuna  # optuna: heavy, imported on first use
    from optuna.storages import RetryHeartbeatStaleTrialCallback  # optuna: heavy, imported on first use
    from sqlalchemy.engine import make_url  # sqlalchemy: heavy, imported on first use

    try:
        parsed, address = make_url(url), url  # a malformed URL: sqlalchemy's ArgumentError, reported by the caller
    except ValueError as e:  # e.g. a port that is no number (sqlalchemy's int() of it)
        raise AutoparError(f"cannot open Optuna storage {shown(url)}: {e}; give a URL like "
                           f"postgresql://USER:PASSWORD@HOST:PORT/DATABASE") from None
    if parsed.drivername == "postgresql":  # SQLAlchemy 2.0 would load psycopg2, 2.1 psycopg
        address = parsed.set(drivername=f"postgresql+{POSTGRES_DRIVER}").render_as_string(hide_password=False)
    kwargs = {}
    if parsed.get_backend_name() != "sqlite":
        # a pooled connection the server or the network dropped between trials (idle timeouts, a
        # server restart) is replaced before use instead of failing the next trial
        kwargs["engine_kwargs"] = {"pool_pre_ping": True}
    try:
        storage = optuna.storages.RDBStorage(address, heartbeat_interval=HEARTBEAT_S, grace_period=GRACE_S,
                                             heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(RETRIES),
                                             **kwargs)
    except ImportError as e:  # the URL's database driver is not installed (Optuna re-raises SQLAlchemy's)
        module = getattr(e.__cause__, "name", None) or e.name
        hint = DRIVERS.get(module, "install the database driver that SQLAlchemy loads for it")
        raise AutoparError(f"cannot open Optuna storage {shown(url)}: no module {module!r}; {hint}") from None
    if storage.engine.dialect.name == "sqlite":
        from sqlalchemy import event  # sqlalchemy: heavy, imported on first use

        event.listen(storage.engine, "connect", _sqlite_wal)
        storage.engine.dispose()  # reconnect with the pragmas
    return storage


def _sqlite_wal(connection, _record) -> None:
    """Optuna commits some 25 times a trial; on SQLite each commit waited for the disk, and a
    200-trial study took minutes. WAL mode without a sync per commit loses nothing that was
    committed when the process is killed (a power cut may lose the last trials)."""
    cursor = connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


def shown(url: str) -> str:
    """The URL as messages print it: a server's password masked, read from the text itself (a password
    holding an unescaped @, or a URL sqlalchemy cannot read, must not leak either): user:password@ up to
    the last @ becomes user:***@, and a password query parameter ***."""
    text = re.sub(r"(//[^:/@]*):.*@", r"\1:***@", url)
    return repr(re.sub(r"(password=)[^&]*", r"\1***", text))
