"""Metrics that cannot be written (a full disk) are dropped with one warning; training goes on."""


def test_metrics_that_cannot_be_written_are_dropped_with_one_warning(tmp_path, capsys):
    import errno

    from triax.tracking.throughput import MetricsLogger

    logger = MetricsLogger(str(tmp_path), enabled=True, loggers=["jsonl"], progress=False)

    class FullDisk:
        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

        def close(self):
            raise OSError(errno.ENOSPC, "No space left on device")

    (jsonl,) = logger.trackers
    jsonl._handle.close()
    jsonl._handle = FullDisk()
    logger.log(1, {"loss": 1.0})
    logger.log(2, {"loss": 0.5})  # training goes on; nothing more is attempted
    logger.close()
    err = capsys.readouterr().err
    assert err.count("cannot append") == 1 and "No space left" in err
