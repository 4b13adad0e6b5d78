class ConfigError(Exception):
    """A setting or input the user must fix; shown as one line, exit code 2."""
