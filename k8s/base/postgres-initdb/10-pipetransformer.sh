#!/bin/sh
# First start of the postgres StatefulSet (k8s/base/postgres.yaml): the official image runs this
# once, on an empty data directory, as the superuser over the local socket.
#
#   pipetransformer     LOGIN, owns database `pipetransformer` and its `public` schema: the
#                       migrations create the tables as this role; the controller writes.
#   pipetransformer_ro  LOGIN, SELECT on every table `pipetransformer` creates there, now or
#                       later (ALTER DEFAULT PRIVILEGES): the dashboard. Read-only by default
#                       too (default_transaction_read_only), and no CREATE anywhere.
#   postgres            the superuser loses its password: local socket only (kubectl exec).
#
# Passwords: $POSTGRES_PASSWORD and $POSTGRES_READONLY_PASSWORD, from Secret postgres-credentials.
# They go to the server as psql variables (quoted by psql), never through the shell's text.
set -eu
: "${POSTGRES_PASSWORD:?from Secret postgres-credentials, key password}"
: "${POSTGRES_READONLY_PASSWORD:?from Secret postgres-credentials, key readonly-password}"

psql --no-psqlrc -v ON_ERROR_STOP=1 --username "${POSTGRES_USER:-postgres}" --dbname postgres \
    --set=owner_password="$POSTGRES_PASSWORD" \
    --set=readonly_password="$POSTGRES_READONLY_PASSWORD" <<'SQL'
CREATE ROLE pipetransformer LOGIN PASSWORD :'owner_password';
CREATE ROLE pipetransformer_ro LOGIN PASSWORD :'readonly_password';
ALTER ROLE pipetransformer_ro SET default_transaction_read_only = on;
CREATE DATABASE pipetransformer OWNER pipetransformer;
REVOKE ALL ON DATABASE pipetransformer FROM PUBLIC;
GRANT CONNECT ON DATABASE pipetransformer TO pipetransformer_ro;

\connect pipetransformer
-- PostgreSQL 15+: `public` belongs to the database owner and PUBLIC may not CREATE in it.
ALTER SCHEMA public OWNER TO pipetransformer;
REVOKE CREATE ON SCHEMA public FROM PUBLIC;
GRANT USAGE ON SCHEMA public TO pipetransformer_ro;
GRANT SELECT ON ALL TABLES IN SCHEMA public TO pipetransformer_ro;
ALTER DEFAULT PRIVILEGES FOR ROLE pipetransformer IN SCHEMA public
    GRANT SELECT ON TABLES TO pipetransformer_ro;
ALTER DEFAULT PRIVILEGES FOR ROLE pipetransformer IN SCHEMA public
    GRANT SELECT ON SEQUENCES TO pipetransformer_ro;

\connect postgres
ALTER ROLE CURRENT_USER PASSWORD NULL;
SQL
