"""The platform's settings: one object, from flags, environment variables (`LORAPLEX_*`) and an
optional TOML file, in that order of precedence. Unknown keys and bad values stop start-up with a
message naming them."""

from __future__ import annotations

import os
import secrets
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from loraplex.engine.api import EngineConfig
from loraplex.home import data_dir as default_data_dir

ENV_PREFIX = "LORAPLEX_"
# Variables of that prefix read elsewhere, not settings.
_OTHER_VARIABLES = {"LORAPLEX_HOME", "LORAPLEX_ADMIN_URL"}
_PLACEHOLDER_TOKENS = {"changeme", "change-me", "change_me", "secret", "admin", "token", "password"}
MIN_ADMIN_TOKEN_LENGTH = 16
TOKEN_FILE = "admin_token"


class SettingsError(ValueError):
    """Settings that cannot start a server; the message names each offending key."""


class EngineSettings(BaseModel):
    """The engine's knobs (`[engine]` in the TOML file, `LORAPLEX_ENGINE__*` in the
    environment); see loraplex.engine.config.EngineConfig for what each does."""

    model_config = ConfigDict(extra="forbid")

    dtype: str = "auto"  # bfloat16 where the device computes it natively, else float32
    device: str = "cpu"
    memory_budget: int | str = "2GiB"
    num_pages: int | None = None
    page_size: int = 16
    max_num_batched_tokens: int = 256
    max_num_seqs: int = 64
    max_model_len: int | None = None
    num_threads: int | None = None
    seed: int = 0
    max_lora_rank: int = 128
    adapter_host_cache: int | str = "1GiB"
    lora_backend: str | None = None
    enable_prefix_caching: bool = True
    scheduling_policy: Literal["fair", "fcfs"] = "fair"  # fair shares between tenants, tiers


class RaySettings(BaseModel):
    """Scale-out on Ray Serve (`loraplex serve --ray`, `[ray]` in the TOML file,
    `LORAPLEX_RAY__*` in the environment); see docs/scaling.md."""

    model_config = ConfigDict(extra="forbid")

    address: str | None = None  # a running cluster ("auto", "ray://..."); None: start one here
    num_cpus: int | None = None  # CPUs of the Ray instance started here (None: all)
    engine_replicas: int = Field(2, ge=1)  # at start; autoscaled up to max_engine_replicas
    max_engine_replicas: int | None = None  # None: a fixed number of replicas
    ingress_replicas: int = Field(1, ge=1)
    engine_cpus: float = Field(0.5, gt=0)  # Ray resources of one engine replica
    engine_gpus: float = Field(0, ge=0)  # 1 on a GPU cluster: one replica per GPU
    ingress_cpus: float = Field(0.25, gt=0)
    # adapters a replica holds for routing (Ray's multiplexing); requests for them go there
    adapters_per_replica: int = Field(64, ge=1)
    max_ongoing_requests: int = Field(256, ge=1)  # per engine replica, before Ray queues
    target_ongoing_requests: float = Field(32, gt=0)  # the autoscaler's aim per replica
    # the same request again on another replica when its replica died before its first token
    retries: int = Field(4, ge=0)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_nested_delimiter="__", extra="forbid", validate_default=True
    )

    model: str = "default"  # a checkpoint directory, or "default" (SmolLM2-135M-Instruct)
    served_model_name: str | None = None  # the base model's id in the API; from `model` if unset
    admin_token: SecretStr | None = None  # else read from <data_dir>/admin_token
    data_dir: Path = Field(default_factory=default_data_dir)
    database_url: str | None = None  # default: SQLite in the data dir
    adapter_roots: Annotated[list[str] | None, NoDecode] = None  # None: any directory
    redis_url: str | None = None  # shared rate limits across server processes
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    dev_mode: bool = False  # allows a weak admin token
    max_waiting_requests: int = Field(256, ge=1)  # beyond: 503 at once
    usage_flush_seconds: float = Field(0.5, gt=0)
    # Batch API: requests of each job in flight at once (the engine serves interactive ones
    # first), and how often jobs are looked for (a job made through another process)
    batch_concurrency: int = Field(4, ge=1, le=1024)
    batch_poll_seconds: float = Field(1.0, gt=0)
    # how often each process checks the registry for changes made elsewhere (revoked keys,
    # disabled tenants, deleted adapters apply everywhere within this; at most 0.5 s)
    registry_poll_seconds: float = Field(0.25, gt=0, le=0.5)
    shutdown_grace_seconds: float = Field(30.0, ge=0)
    log_level: str = "info"
    log_format: Literal["json", "text"] = "json"
    log_requests: bool = True  # a JSON line per request: ids, status, tokens, latency; no text
    engine: EngineSettings = EngineSettings()
    ray: RaySettings = RaySettings()

    @field_validator("adapter_roots", mode="before")
    @classmethod
    def _split_roots(cls, value: Any) -> Any:
        if isinstance(value, str):  # PATH-style from the environment: "/a:/b"
            return [part for part in value.split(os.pathsep) if part]
        return value

    @property
    def database(self) -> str:
        return self.database_url or f"sqlite:///{self.data_dir / 'loraplex.db'}"

    @property
    def adapter_store(self) -> Path:
        """Registered adapters, copied here by content hash."""
        return self.data_dir / "adapters"

    @property
    def upload_dir(self) -> Path:
        return self.data_dir / "uploads"

    def engine_config(self) -> EngineConfig:
        roots = None
        if self.adapter_roots is not None:
            roots = (*self.adapter_roots, str(self.adapter_store), str(self.upload_dir))
        return EngineConfig(
            model=self.model,
            adapter_roots=roots,
            max_waiting_requests=self.max_waiting_requests,
            **self.engine.model_dump(),
        )


def load_settings(config_file: Path | None = None, **overrides: Any) -> Settings:
    """Flags (`overrides`, None values skipped) > environment > TOML file > defaults."""
    _check_environment()
    file_values = _read_toml(config_file) if config_file else {}
    flags = {k: v for k, v in overrides.items() if v is not None}

    class _Sources(Settings):
        @classmethod
        def settings_customise_sources(
            cls, settings_cls, init_settings, env_settings, dotenv_settings, file_secret_settings
        ):
            return (init_settings, env_settings, _DictSource(settings_cls, file_values))

    try:
        return _Sources(**flags)
    except ValidationError as error:
        raise SettingsError(_describe(error)) from None


def admin_token(settings: Settings, create: bool = False) -> tuple[str, Path | None]:
    """The admin token and the file it came from (None: the settings). With `create`, a token
    is generated into the data dir when there is none. Refuses weak tokens outside dev mode."""
    if settings.admin_token is not None:
        token, source = settings.admin_token.get_secret_value(), None
    else:
        source = settings.data_dir / TOKEN_FILE
        if not source.is_file():
            if not create:
                raise SettingsError(
                    f"no admin token: set {ENV_PREFIX}ADMIN_TOKEN, or write one into {source}"
                )
            source.parent.mkdir(parents=True, exist_ok=True)
            source.touch(mode=0o600)
            source.write_text(secrets.token_urlsafe(32) + "\n")
        token = source.read_text().strip()
    weak = not token or token.lower() in _PLACEHOLDER_TOKENS or len(token) < MIN_ADMIN_TOKEN_LENGTH
    if weak and not settings.dev_mode:
        raise SettingsError(
            f"the admin token is empty, a placeholder or shorter than {MIN_ADMIN_TOKEN_LENGTH} "
            f"characters; set a strong {ENV_PREFIX}ADMIN_TOKEN (or {ENV_PREFIX}DEV_MODE=1)"
        )
    return token, source


class _DictSource:
    """A settings source over values already read (the TOML file)."""

    def __init__(self, settings_cls, values: dict) -> None:
        self.values = values

    def __call__(self) -> dict:
        return self.values


def _read_toml(path: Path) -> dict:
    try:
        return tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise SettingsError(f"config file {path}: {error}") from None


def _check_environment() -> None:
    known = {f"{ENV_PREFIX}{name.upper()}" for name in Settings.model_fields}
    known |= {f"{ENV_PREFIX}ENGINE__{name.upper()}" for name in EngineSettings.model_fields}
    known |= {f"{ENV_PREFIX}RAY__{name.upper()}" for name in RaySettings.model_fields}
    unknown = sorted(
        name
        for name in os.environ
        if name.upper().startswith(ENV_PREFIX) and name.upper() not in known | _OTHER_VARIABLES
    )
    if unknown:
        raise SettingsError(f"unknown environment variables: {', '.join(unknown)}")


def _describe(error: ValidationError) -> str:
    lines = []
    for problem in error.errors():
        where = ".".join(str(part) for part in problem["loc"]) or "settings"
        if problem["type"] == "extra_forbidden":
            lines.append(f"{where}: unknown setting")
        else:
            lines.append(f"{where}: {problem['msg']} (got {problem.get('input')!r})")
    return "invalid settings:\n  " + "\n  ".join(lines)
