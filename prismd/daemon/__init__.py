"""The daemon: config, state directory, supervisor, wiring of agents and adapters to the
runtime, systemd notification, logs and metrics."""

from ._config import Config as Config
from ._config import ConfigError as ConfigError
from ._config import GrantConfig as GrantConfig
from ._config import TelegramConnectionConfig as TelegramConnectionConfig
from ._config import is_loopback_host as is_loopback_host
from ._config import load_config as load_config
from ._config import parse_host_port as parse_host_port
from ._config import read_secret as read_secret
from ._daemon import install_early_signal_handlers as install_early_signal_handlers
from ._daemon import run_daemon as run_daemon
from ._daemon import take_early_signal as take_early_signal
from ._logs import configure_logging as configure_logging
from ._runnable import check_runnable as check_runnable
from ._runnable import config_warnings as config_warnings
from ._runnable import relative_paths_warning as relative_paths_warning
from ._supervisor import describe_exception as describe_exception
