#pragma once
// The registry schema as an ordered list of migrations; PRAGMA user_version is the
// number of migrations applied. Append a migration to change the schema — never edit
// one that has shipped.
#include "registry/db.hpp"

namespace lar::registry {

// Bring `db` to the newest schema. Safe when several processes open a fresh database at
// once: the version is re-read inside BEGIN IMMEDIATE, so exactly one process applies
// each migration and the others see it done.
void migrate(Db& db);

// Connection settings every registry connection uses (WAL, synchronous=NORMAL, …).
void configure_connection(Db& db, bool read_only);

}  // namespace lar::registry
