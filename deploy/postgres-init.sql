-- Run once by the postgres image's entrypoint on an empty data directory (docker-entrypoint-initdb.d):
-- one server, three databases owned by the POSTGRES_USER role. Idempotent: safe to run again by hand with
--   psql -U privbench -d postgres -f deploy/postgres-init.sql
-- privbench: the results store (PRIVBENCH_DB_URL); prefect: the Prefect server; mlflow: the MLflow backend store.
SELECT 'CREATE DATABASE privbench' WHERE NOT EXISTS (SELECT FROM pg_database WHERE datname = 'privbench')\gexec
SELECT 'CREATE DATABASE prefect' WHERE NOT EXISTS (SELECT FROM pg_database WHERE datname = 'prefect')\gexec
SELECT 'CREATE DATABASE mlflow' WHERE NOT EXISTS (SELECT FROM pg_database WHERE datname = 'mlflow')\gexec
