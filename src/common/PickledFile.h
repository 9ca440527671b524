// Files of dtrain's own state (shard and federated-server checkpoints, a rank's state file): a
// dictionary pickled by LibTorch (torch::pickle_save), written atomically, read back with one
// check of what it is before anything of it is used.
#pragma once

#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>

#include <string>

namespace dtrain {

/// Pickles `dict` into `path` atomically (a reader sees the old file or the new one), creating
/// its directory.
void save_pickled_dict(const std::string& path, const c10::impl::GenericDict& dict);

/// The dictionary pickled in `path`. InputError naming the file and `what` it should be ("a
/// parameter-server shard checkpoint") when it cannot be read, does not unpickle (damaged?), is
/// no dictionary, or - with a `format` - does not say that format under "format".
c10::impl::GenericDict load_pickled_dict(const std::string& path, const std::string& what,
                                         const std::string& format = "");

}  // namespace dtrain
