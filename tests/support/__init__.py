"""What the tests share: running the programs (cli.py), a GCS server with outages (gcs.py), a fake cloud and its
hosts (cloud.py, fake_hosts/), the start-up of the processes the tests start (site/), and golden files (golden/)."""
