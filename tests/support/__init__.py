"""What the tests share: running the programs (cli.py), a GCS server with outages (gcs.py), a fake cloud and its
hosts (cloud.py, fake_hosts/), and golden files (golden/)."""
