// dtrain's public API in one include.
#pragma once

#include "dtrain/comm/Communicator.h"
#include "dtrain/comm/ProcessGrid.h"
#include "dtrain/common/Error.h"
#include "dtrain/data/Dataset.h"
#include "dtrain/data/DistributedSampler.h"
#include "dtrain/data/FashionMnist.h"
#include "dtrain/launch/Environment.h"
#include "dtrain/launch/Launcher.h"
#include "dtrain/models/Model.h"
#include "dtrain/models/Zoo.h"
#include "dtrain/optim/LrSchedule.h"
#include "dtrain/optim/Optimizers.h"
#include "dtrain/parallel/Strategy.h"
#include "dtrain/train/Checkpoint.h"
#include "dtrain/train/Trainer.h"
