// An engine header.
#pragma once
